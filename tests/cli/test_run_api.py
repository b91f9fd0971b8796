"""hvdrun.run's arguments: Horovod's names become hvdrun's flags; bad ones fail at once.

Each test here fails before any process starts (or records the command line the CLI was
given); tests/launcher/test_run_function.py runs real jobs.
"""

from __future__ import annotations

import io
import logging
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import hvdrun
from hvdrun import api
from hvdrun.calls import FunctionCall


@pytest.fixture
def command_line(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The hvdrun command lines hvdrun.run would run (none is run)."""
    seen: list[list[str]] = []

    def record(argv: list[str], call: FunctionCall) -> int:
        seen.append(argv)
        raise SystemExit("recorded")

    monkeypatch.setattr(api, "_invoke", record)
    return seen


def flags_of(command_line: list[list[str]], **arguments: Any) -> list[str]:
    with pytest.raises(SystemExit, match="recorded"):
        hvdrun.run(print, **arguments)
    argv = command_line[-1]
    return argv[: argv.index("--")]


def test_horovods_arguments_become_hvdruns_flags(command_line: list[list[str]]) -> None:
    flags = flags_of(
        command_line,
        num_proc=4,
        hosts="a:2,b:2",
        start_timeout=30,
        ssh_port=2222,
        ssh_identity_file="/k",
        output_filename="/tmp/out",
        verbose=2,
        use_gloo=True,
        network_interface="eth0",
        disable_cache=True,
    )
    assert flags == [
        "--num-proc", "4", "--hosts", "a:2,b:2", "--start-timeout", "30", "--ssh-port", "2222",
        "--ssh-identity-file", "/k", "--disable-cache", "--output-filename", "/tmp/out",
        "--verbose", "--gloo", "--network-interface", "eth0",
    ]  # fmt: skip
    elastic = flags_of(
        command_line,
        min_num_proc=1,
        max_num_proc=3,
        slots=2,
        reset_limit=5,
        cooldown_range=(1, 10),
        hostfile="/hosts",
    )
    # (no -np: an elastic job starts with hvdrun's default, --min-np, not Horovod's 1)
    assert elastic == [
        "--min-num-proc", "1", "--max-num-proc", "3", "--slots-per-host", "2",
        "--reset-limit", "5", "--blacklist-cooldown-range", "1", "10", "--hostfile", "/hosts",
    ]  # fmt: skip


def test_each_worker_runs_the_task_module_with_the_python_given(
    command_line: list[list[str]],
) -> None:
    with pytest.raises(SystemExit):
        hvdrun.run(print, executable="/opt/py/bin/python3")
    argv = command_line[-1]
    assert argv[argv.index("--") + 1 :] == ["/opt/py/bin/python3", "-m", "collectives.run_task"]


def test_np_min_np_max_np_are_deprecated_spellings(command_line: list[list[str]]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flags = flags_of(command_line, np=3, min_np=2, max_np=4, hosts="a:4")
    assert flags[:6] == ["--num-proc", "3", "--min-num-proc", "2", "--max-num-proc", "4"]
    assert [str(w.message) for w in caught] == [
        "np is deprecated, use num_proc instead",
        "min_np is deprecated, use min_num_proc instead",
        "max_np is deprecated, use max_num_proc instead",
    ]
    assert all(w.category is DeprecationWarning for w in caught)
    # as in Horovod, num_proc wins where both are given
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert flags_of(command_line, num_proc=2, np=5)[:2] == ["--num-proc", "2"]


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"num_proc": 0}, ValueError, "invalid '-np': must be at least 1, got 0"),
        ({"hosts": "a:1", "hostfile": "/h"}, ValueError, "give hosts or hostfile, not both"),
        ({"use_gloo": True, "use_mpi": True}, ValueError, "give use_gloo or use_mpi, not both"),
        ({"use_mpi": True}, ValueError, "hvdrun does not drive MPI"),
        ({"hosts": "bad host"}, ValueError, "host name 'bad host' contains white space"),
        ({"cooldown_range": 5}, TypeError, "cooldown_range must be (min_seconds, max_seconds)"),
        ({"hosts": ["a", "b"]}, TypeError, "hosts must be a string"),
        ({"start_timeout": "soon"}, TypeError, "start_timeout must be a number of seconds"),
    ],
)
def test_bad_arguments_raise_before_anything_starts(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        hvdrun.run(print, **arguments)
    assert str(raised.value).startswith("hvdrun.run: ")
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"hosts": 123}, TypeError, "hosts must be a string, got 123"),
        ({"hostfile": 3}, TypeError, "hostfile must be a path (a string), got 3"),
        ({"executable": 5}, TypeError, "executable must be a path (a string), got 5"),
        ({"num_proc": "2"}, TypeError, "num_proc must be an integer, got '2'"),
        ({"ssh_port": 22.0}, TypeError, "ssh_port must be an integer, got 22.0"),
        ({"use_gloo": "no"}, TypeError, "use_gloo must be True or False, got 'no'"),
        ({"start_timeout": float("nan")}, ValueError, "start_timeout must be a finite number"),
        ({"cooldown_range": (1, float("inf"))}, ValueError, "cooldown_range must be a finite"),
        ({"args": "ab"}, TypeError, "args must be a tuple or list of func's positional"),
        ({"args": None}, TypeError, "args must be a tuple or list"),
        ({"kwargs": [("a", 1)]}, TypeError, "kwargs must be a dict of func's keyword arguments"),
        ({"kwargs": {1: 2}}, TypeError, "kwargs' keys must be strings, got 1"),
    ],
)
def test_arguments_of_the_wrong_type_are_named_before_anything_starts(
    command_line: list[list[str]], arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        hvdrun.run(print, **arguments)
    assert str(raised.value).startswith("hvdrun.run: ")
    assert message in str(raised.value)
    assert command_line == []


def test_paths_may_be_path_objects(command_line: list[list[str]]) -> None:
    flags = flags_of(
        command_line,
        hostfile=Path("/hosts"),
        ssh_identity_file=Path("/k"),
        output_filename=Path("/out"),
        executable=Path("/opt/py/bin/python3"),
    )
    assert flags == [
        "--num-proc", "1", "--hostfile", "/hosts", "--ssh-identity-file", "/k",
        "--output-filename", "/out",
    ]  # fmt: skip
    assert command_line[-1][-3] == "/opt/py/bin/python3"


def test_the_callers_logging_is_as_it_was_after_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    handlers = list(root.handlers)
    mine = logging.getLogger("launcher")  # (one of hvdrun's packages, set by the caller)
    monkeypatch.setattr(mine, "level", logging.ERROR)
    with pytest.raises(ValueError, match="--output-filename"):  # (after the CLI set up logging)
        hvdrun.run(print, output_filename="/proc/no/such/dir", verbose=True)
    assert root.handlers == handlers
    assert mine.level == logging.ERROR


def test_during_a_call_the_callers_own_records_stay_the_callers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hvdrun.cli

    seen: list[str] = []
    collector = logging.Handler()
    collector.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(collector)
    refuse = hvdrun.cli.creatable_directory

    def logging_then_refusing(path: str, option: str) -> None:  # (in the job's set-up)
        logging.getLogger("caller.module").warning("from the caller")
        logging.getLogger("launcher.somewhere").warning("from hvdrun")
        refuse(path, option)

    monkeypatch.setattr(hvdrun.cli, "creatable_directory", logging_then_refusing)
    try:
        with pytest.raises(ValueError, match="--output-filename"):
            hvdrun.run(print, output_filename="/proc/no/such/dir")
    finally:
        logging.getLogger().removeHandler(collector)
    err = capsys.readouterr().err
    assert "hvdrun: warning: from hvdrun" in err
    assert "from the caller" not in err  # (not worded as hvdrun's: the caller's handler has it)
    assert seen == ["from the caller"]
    assert logging.getLogger("launcher").propagate  # (as it was, after the call)


def test_paramiko_is_silenced_for_a_call_and_the_callers_again_after_it() -> None:
    from hvdrun.logging_setup import LogSettings, configure_logging, reset_logging

    paramiko = logging.getLogger("paramiko")
    before = (paramiko.propagate, list(paramiko.handlers))
    configure_logging(LogSettings(), in_process=True)
    try:
        assert not paramiko.propagate  # (hvdrun says what SSH failed with, once)
        import launcher.transport.ssh  # noqa: F401  (first imported during a remote job)
    finally:
        reset_logging()
    assert (paramiko.propagate, paramiko.handlers) == before


def test_a_signal_while_the_hosts_start_stops_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import launcher.run
    from launcher.transport.startup import LaunchInterrupted

    def interrupted(*args: object, **kwargs: object) -> None:
        raise LaunchInterrupted(signum)

    monkeypatch.setattr(launcher.run, "run_job", interrupted)
    signum = signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        hvdrun.run(print)
    signum = signal.SIGTERM
    with pytest.raises(hvdrun.JobFailed) as failed:
        hvdrun.run(print)
    assert str(failed.value) == "hvdrun.run: the job was stopped by SIGTERM (exit code 143)"


def test_what_cannot_be_pickled_is_named() -> None:
    with pytest.raises(TypeError, match="cannot be pickled"):
        hvdrun.run(print, args=(threading.Lock(),))
    with pytest.raises(TypeError, match="func must be callable"):
        hvdrun.run(42)  # type: ignore[arg-type]


def test_only_the_main_thread_may_run_a_job() -> None:
    raised: list[BaseException] = []

    def call() -> None:
        try:
            hvdrun.run(print)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert len(raised) == 1 and "main thread" in str(raised[0])


def test_a_text_stream_without_a_buffer_gets_the_decoded_bytes() -> None:
    text = io.StringIO()
    stream = api.binary_stream(text)
    assert stream is not None and not stream.isatty()
    snowman = "☃ done\n".encode()
    stream.write(b"[0]<stdout>:" + snowman[:2])  # a character split between two writes
    stream.write(snowman[2:])
    assert text.getvalue() == "[0]<stdout>:☃ done\n"
    buffered = io.TextIOWrapper(io.BytesIO())
    assert api.binary_stream(buffered) is buffered.buffer


def test_an_exception_without_a_message_is_named_alone() -> None:
    assert api._raised("KeyboardInterrupt", "") == "KeyboardInterrupt"
    assert api._raised("ValueError", "bad shard") == "ValueError: bad shard"


def test_a_job_stopped_by_a_signal_says_which() -> None:
    from launcher.supervision.core import JobResult

    call = FunctionCall({}, "p/", None, None, JobResult(exit_code=143, interrupted_by=15))
    with pytest.raises(hvdrun.JobFailed, match=r"^hvdrun.run: the job was stopped by SIGTERM"):
        api._results(143, call)


def test_a_failure_without_an_exception_names_the_rank_and_how_it_ended() -> None:
    from launcher.supervision.core import JobResult, WorkerFailure, WorkerStop

    def failed(failure: WorkerFailure) -> str:
        call = FunctionCall({}, "p/", None, None, JobResult(exit_code=1, failure=failure))
        with pytest.raises(hvdrun.JobFailed) as raised:
            api._results(1, call)
        assert raised.value.rank == failure.rank and raised.value.exit_code == 1
        return str(raised.value)

    assert failed(WorkerFailure(2, "gpu3", 1)) == "hvdrun.run: rank 2 on gpu3 exited with code 1"
    assert failed(WorkerFailure(0, "gpu1", 137)) == (
        "hvdrun.run: rank 0 on gpu1 was killed by SIGKILL (exit code 137)"
    )
    # a stopped rank is named with its peer's exit code: that code is not its own
    peer = WorkerFailure(0, "gpu1", 1)
    stop = WorkerStop(1, "gpu2", 4242, signal.SIGSTOP, traced=False, since=0.0)
    said = failed(WorkerFailure(1, "gpu2", 1, stop.cause(peer), stop, peer))
    assert said == (
        "hvdrun.run: rank 1 on gpu2 failed first: it was stopped by SIGSTOP (pid 4242) and "
        "never continued; its peers' collectives timed out waiting for it (rank 0 exited "
        "first, with exit code 1)"
    )


def test_hvdruns_own_elastic_keywords(command_line: list[list[str]]) -> None:
    flags = flags_of(
        command_line, min_num_proc=2, host_discovery_script="/bin/hosts.sh", elastic_timeout=60
    )
    assert flags == [
        "--min-num-proc", "2", "--host-discovery-script", "/bin/hosts.sh",
        "--elastic-timeout", "60",
    ]  # fmt: skip
    with pytest.raises(TypeError, match="elastic_timeout must be a number of seconds"):
        hvdrun.run(print, min_num_proc=2, elastic_timeout="soon")  # type: ignore[arg-type]


def test_an_elastic_job_given_up_says_why() -> None:
    from launcher.supervision.core import JobResult

    reason = "Horovod detected that one or more processes exited ...\nonly 1 slot(s) were left"
    call = FunctionCall({}, "p/", None, None, JobResult(exit_code=1, reason=reason))
    with pytest.raises(hvdrun.JobFailed) as raised:
        api._results(1, call)
    assert str(raised.value) == (
        "hvdrun.run: the job failed (exit code 1): only 1 slot(s) were left"
    )


def test_a_stopped_worker_of_a_newer_generation_does_not_hide_the_results() -> None:
    import cloudpickle

    from launcher.supervision.core import JobResult
    from rendezvous import pieces, worker_env

    def outcome(rank: int, generation: int, ok: bool, data: bytes) -> dict[str, bytes]:
        key = f"{worker_env.RESULT_KEY_PREFIX}g{generation}-r{rank}"
        fields = {"rank": rank, "size": 2, "generation": generation, "ok": ok}
        stored, head = pieces.split(key, data, fields)
        return {**stored, key: head}

    collected = {
        **outcome(0, 2, True, cloudpickle.dumps("zero")),
        **outcome(1, 2, True, cloudpickle.dumps("one")),
    }
    # a host added as the job finished: its worker (rank 0 of generation 3), stopped, left
    # an error after rank 0 of generation 2 had left its value
    collected.update(outcome(0, 3, False, b'{"type": "KeyboardInterrupt", "message": ""}'))
    result = JobResult(exit_code=0, collected=collected)
    call = FunctionCall({}, worker_env.RESULT_KEY_PREFIX, None, None, result)
    assert api._results(0, call) == ["zero", "one"]


def test_what_the_caller_cannot_take_back_is_named() -> None:
    from launcher.supervision.core import JobResult, WorkerFailure
    from rendezvous import pieces, worker_env

    key = f"{worker_env.RESULT_KEY_PREFIX}g0-r0"
    stored, head = pieces.split(key, b"not a pickle", {"rank": 0, "size": 1, "generation": 0})
    result = JobResult(exit_code=0, collected={**stored, key: head}, hosts={0: "a"})
    call = FunctionCall({}, worker_env.RESULT_KEY_PREFIX, None, None, result)
    with pytest.raises(hvdrun.JobFailed, match="rank 0 returned a value this process cannot"):
        api._results(0, call)
    # a rank whose host was lost never exited
    lost = JobResult(
        exit_code=255,
        failure=WorkerFailure(1, "b", 255, "x"),
        lost={1: "the connection to host b was lost"},
    )
    call = FunctionCall({}, worker_env.RESULT_KEY_PREFIX, None, None, lost)
    with pytest.raises(hvdrun.JobFailed) as raised:
        api._results(255, call)
    assert (
        str(raised.value) == "hvdrun.run: rank 1 on b was lost: the connection to host b was lost"
    )
    # an elastic job whose workers never took a rank: no count of ranks that never were
    nothing = JobResult(exit_code=0, hosts={0: "a", 1: "a", 2: "b"})
    call = FunctionCall({}, worker_env.RESULT_KEY_PREFIX, None, None, nothing, elastic=True)
    with pytest.raises(hvdrun.JobFailed, match=r"but no rank returned a value.*never calls"):
        api._results(0, call)
