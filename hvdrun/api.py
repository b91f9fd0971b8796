"""``hvdrun.run(fn, ...)``: Horovod's ``horovod.run`` -- a Python function on many processes.

The function, its arguments and keyword arguments are pickled by cloudpickle (so lambdas,
closures and functions defined in ``__main__`` or a notebook travel by value) and the job is
the one ``hvdrun`` would run for the same flags: the same checks and messages, hosts, SSH,
Slurm allocations, elastic jobs and settings. Each worker is ``python -m
collectives.run_task`` (:mod:`collectives.run_task`), which reads the function from the job's
rendezvous store, calls it, and leaves its result there; ``run`` returns the results in rank
order. Workers' output goes to this process's ``sys.stdout`` and ``sys.stderr`` with rank
prefixes, as under ``hvdrun`` (a notebook's streams included).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO, NoReturn, TextIO, cast

import click

from hvdrun.calls import FunctionCall
from launcher.supervision.core import rank_list
from rendezvous import pieces, worker_env

__all__ = ["JobFailed", "run"]

#: What each worker runs: the module that reads the function, calls it and stores its result.
TASK_MODULE = "collectives.run_task"


class JobFailed(RuntimeError):
    """The job of ``hvdrun.run`` failed: a rank's function raised or its process exited with
    a non-zero code, or the job was stopped. ``rank`` and ``exit_code`` say which and how
    (None where no rank failed first, such as a host that was lost); ``error_type`` and
    ``error`` are the exception the function raised, when it raised one."""

    def __init__(
        self,
        message: str,
        *,
        exit_code: int,
        rank: int | None = None,
        error_type: str | None = None,
        error: str | None = None,
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.rank = rank
        self.error_type = error_type
        self.error = error


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[float, float] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: int | bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    host_discovery_script: str | os.PathLike[str] | None = None,
    elastic_timeout: float | None = None,
) -> list[Any]:
    """Runs ``func(*args, **kwargs)`` in ``num_proc`` processes as one hvdrun job and returns
    the values they returned, in rank order (elastic jobs: the ranks of the last membership
    generation). Takes Horovod's arguments, each as the ``hvdrun`` flag of the same name;
    ``np``, ``min_np`` and ``max_np`` are Horovod's deprecated spellings; hvdrun adds
    ``host_discovery_script`` and ``elastic_timeout`` (keywords only). Raises ValueError
    for bad arguments (the message hvdrun would print for the flag), :class:`JobFailed` when
    the job fails, and KeyboardInterrupt after Ctrl-C has stopped it."""
    num_proc = _renamed("np", "num_proc", np, num_proc)
    min_num_proc = _renamed("min_np", "min_num_proc", min_np, min_num_proc)
    max_num_proc = _renamed("max_np", "max_num_proc", max_np, max_num_proc)
    elastic = any(x is not None for x in (min_num_proc, max_num_proc, host_discovery_script))
    if num_proc is None and not elastic:
        num_proc = 1  # (Horovod's default; an elastic job's is hvdrun's: --min-np)
    if not callable(func):
        raise TypeError(f"hvdrun.run: func must be callable, got {type(func).__name__}")
    _check_call_arguments(args, kwargs)
    if hosts is not None and hostfile is not None:
        raise ValueError("hvdrun.run: give hosts or hostfile, not both")
    if use_gloo and use_mpi:
        raise ValueError("hvdrun.run: give use_gloo or use_mpi, not both")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "hvdrun.run must be called from the main thread: it stops the job on Ctrl-C and "
            "SIGTERM, whose handlers only the main thread may install"
        )
    argv = _flags(
        num_proc=num_proc,
        min_num_proc=min_num_proc,
        max_num_proc=max_num_proc,
        slots=slots,
        reset_limit=reset_limit,
        cooldown_range=cooldown_range,
        hosts=hosts,
        hostfile=hostfile,
        start_timeout=start_timeout,
        ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file,
        disable_cache=disable_cache,
        output_filename=output_filename,
        verbose=verbose,
        use_gloo=use_gloo,
        use_mpi=use_mpi,
        mpi_args=mpi_args,
        network_interface=network_interface,
        host_discovery_script=host_discovery_script,
        elastic_timeout=elastic_timeout,
    )
    argv += ["--", _path("executable", executable) or sys.executable, "-m", TASK_MODULE]
    stored, head = pieces.split(worker_env.FUNCTION_KEY, _payload(func, args, kwargs))
    call = FunctionCall(
        preset={**stored, worker_env.FUNCTION_KEY: head},
        collect=worker_env.RESULT_KEY_PREFIX,
        stdout=binary_stream(sys.stdout),
        stderr=binary_stream(sys.stderr),
        elastic=elastic,
    )
    code = _invoke(argv, call)
    return _results(code, call)


def _renamed(old: str, new: str, value: int | None, given: int | None) -> int | None:
    """Horovod's deprecated spelling ``old`` of ``new``: it counts where ``new`` was not
    given, with Horovod's DeprecationWarning."""
    if value is None:
        return given
    warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=3)
    return value if given is None else given


#: argument -> the hvdrun flag it becomes (a value, or a switch where True)
_VALUE_FLAGS = {
    "num_proc": "--num-proc",
    "min_num_proc": "--min-num-proc",
    "max_num_proc": "--max-num-proc",
    "slots": "--slots-per-host",
    "reset_limit": "--reset-limit",
    "hosts": "--hosts",
    "hostfile": "--hostfile",
    "start_timeout": "--start-timeout",
    "ssh_port": "--ssh-port",
    "ssh_identity_file": "--ssh-identity-file",
    "output_filename": "--output-filename",
    "mpi_args": "--mpi-args",
    "network_interface": "--network-interface",
    "host_discovery_script": "--host-discovery-script",
    "elastic_timeout": "--elastic-timeout",
}
_SWITCHES = {
    "disable_cache": "--disable-cache",
    "verbose": "--verbose",
    "use_gloo": "--gloo",
    "use_mpi": "--mpi",
}


def _flags(**values: Any) -> list[str]:
    """The hvdrun command line (without the command) that the arguments given stand for.
    A value of the wrong type is a TypeError naming its argument; a number that is not
    finite, a ValueError (hvdrun's own checks follow in the CLI)."""
    argv: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        if name in _SWITCHES:
            if not isinstance(value, int):  # (bool is an int; Horovod's verbose may be a level)
                raise TypeError(f"hvdrun.run: {name} must be True or False, got {value!r}")
            if value:
                argv.append(_SWITCHES[name])
        elif name == "cooldown_range":
            low, high = (_seconds(name, end) for end in _pair(value))
            argv += ["--blacklist-cooldown-range", str(low), str(high)]
        elif name in ("start_timeout", "elastic_timeout"):
            argv += [_VALUE_FLAGS[name], str(_seconds(name, value))]
        elif name in _PATHS:
            argv += [_VALUE_FLAGS[name], _path(name, value) or ""]
        elif name in _TEXT:
            if not isinstance(value, str):
                raise TypeError(f"hvdrun.run: {name} must be a string, got {value!r}")
            argv += [_VALUE_FLAGS[name], value]
        else:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"hvdrun.run: {name} must be an integer, got {value!r}")
            argv += [_VALUE_FLAGS[name], str(value)]
    return argv


#: arguments whose values are text (host lists, interface names)
_TEXT = {"hosts", "mpi_args", "network_interface"}
#: arguments whose values are paths (a string or an os.PathLike, such as pathlib.Path)
_PATHS = {"hostfile", "ssh_identity_file", "output_filename", "host_discovery_script"}


def _path(name: str, value: Any) -> str | None:
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise TypeError(f"hvdrun.run: {name} must be a path (a string), got {value!r}")
    return path


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"hvdrun.run: {name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"hvdrun.run: {name} must be a finite number of seconds, got {value!r}")
    return value


def _pair(value: Any) -> tuple[Any, Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(
            f"hvdrun.run: cooldown_range must be (min_seconds, max_seconds), got {value!r}"
        )
    return value[0], value[1]


def _check_call_arguments(args: Any, kwargs: Any) -> None:
    """``args`` and ``kwargs`` as ``func(*args, **kwargs)`` takes them, checked here rather
    than in every worker once the job has started."""
    if isinstance(args, (str, bytes, bytearray)) or not isinstance(args, Sequence):
        raise TypeError(
            "hvdrun.run: args must be a tuple or list of func's positional arguments, got "
            f"{type(args).__name__} {args!r:.80}"
            + (f" (for one argument: args=({args!r:.40},))" if isinstance(args, str) else "")
        )
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping):
        raise TypeError(
            f"hvdrun.run: kwargs must be a dict of func's keyword arguments, got "
            f"{type(kwargs).__name__} {kwargs!r:.80}"
        )
    names = [key for key in kwargs if not isinstance(key, str)]
    if names:
        raise TypeError(f"hvdrun.run: kwargs' keys must be strings, got {names[0]!r}")


def _payload(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> bytes:
    import cloudpickle

    try:
        return cast(bytes, cloudpickle.dumps((func, tuple(args), dict(kwargs or {}))))
    except Exception as exc:
        raise TypeError(
            f"hvdrun.run: the function or its arguments cannot be pickled ({exc}); every "
            "worker gets a pickled copy of them"
        ) from exc


def _invoke(argv: list[str], call: FunctionCall) -> int:
    """Runs the CLI on ``argv`` with ``call``: its exit code; a user's mistake raises."""
    from hvdrun.cli import cli, usage_message
    from hvdrun.logging_setup import reset_logging

    for stream in (sys.stdout, sys.stderr):
        _flush(stream)  # (what was written before comes first)
    limit = _open_files_limit()
    try:
        code = cli.main(args=argv, prog_name="hvdrun", standalone_mode=False, obj=call)
    except click.UsageError as exc:
        raise ValueError(f"hvdrun.run: {usage_message(exc)}") from None
    except click.ClickException as exc:
        raise JobFailed(f"hvdrun.run: {exc.format_message()}", exit_code=exc.exit_code) from None
    except click.Abort:
        raise KeyboardInterrupt from None
    finally:
        reset_logging()  # (the CLI set logging up for the job: the caller's comes back)
        _give_back_open_files_limit(limit)
    return code if isinstance(code, int) else 0


def _open_files_limit() -> tuple[int, int] | None:
    """The soft and hard limits on open files (None where there are none to read)."""
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None


def _give_back_open_files_limit(before: tuple[int, int] | None) -> None:
    """Lowers the soft limit on open files to what it was before the job, where the job's
    rendezvous raised it (it is done with its connections)."""
    now = _open_files_limit()
    if before is None or now is None or now[0] == before[0] or now[1] != before[1]:
        return
    import resource

    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def _results(code: int, call: FunctionCall) -> list[Any]:
    """The ranks' return values, or the job's failure raised."""
    import cloudpickle

    result = call.result
    collected = result.collected if result is not None else {}
    outcomes = {}
    for key in collected:
        name = key[len(worker_env.RESULT_KEY_PREFIX) :]
        if "/" in name:
            continue  # a piece
        try:
            data, fields = pieces.joined(key, collected.__getitem__)
        except (KeyError, pieces.PiecesError):
            continue
        outcomes[name] = (data, fields)
    if code != 0 or result is None:
        _raise_failure(code, call, outcomes)
    # (the fixed job's ranks, where none left a result; an elastic job's are not known)
    ranks = 0 if call.elastic else len(result.hosts)
    # The job succeeded: its last generation is the newest that returned values (a worker
    # of a newer one that hvdrun stopped as the job finished may have left an error).
    returned = [(data, fields) for data, fields in outcomes.values() if fields.get("ok", True)]
    last = max((fields["generation"] for _, fields in returned), default=0)
    mine = {
        fields["rank"]: (data, fields)
        for data, fields in returned
        if fields["generation"] == last and fields["rank"] >= 0
    }
    size = max((fields["size"] for _, fields in mine.values()), default=ranks)
    missing = [rank for rank in range(max(size, len(mine))) if rank not in mine]
    if missing or not mine:
        what = (
            f"rank(s) {rank_list(missing)} returned nothing"
            if missing
            else "no rank returned a value"
        )
        how = (
            " (in an elastic job, a function that never calls hvd.init() has no rank)"
            if call.elastic
            else ""
        )
        raise JobFailed(
            f"hvdrun.run: the job ended, but {what}: the function left its process some "
            f"other way (such as os._exit(0)){how}",
            exit_code=0,
            rank=missing[0] if missing else None,
        )
    values = []
    for rank in range(size):
        try:
            values.append(cloudpickle.loads(mine[rank][0]))
        except Exception as exc:  # (a CUDA tensor on a machine without CUDA, a class not here)
            raise JobFailed(
                f"hvdrun.run: rank {rank} returned a value this process cannot unpickle: "
                f"{type(exc).__name__}: {exc}",
                exit_code=0,
                rank=rank,
            ) from exc
    return values


def _raised(error_type: str, error: str) -> str:
    """``Type: message``, or ``Type`` alone for an exception without a message."""
    return f"{error_type}: {error}" if error else error_type


def _raise_failure(
    code: int, call: FunctionCall, outcomes: dict[str, tuple[bytes, dict[str, Any]]]
) -> NoReturn:
    from launcher.supervision.report import describe_exit, exit_signal

    result = call.result
    # (no result: a signal stopped the job while its hosts were starting)
    stopped_by = result.interrupted_by if result is not None else call.interrupted_by
    if stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    failure = result.failure if result is not None else None
    if failure is None and not stopped_by:
        _raise_raised(code, outcomes)  # (an elastic job: its failed hosts have no rank)
    if failure is None:
        how = f"was stopped by {signal.Signals(stopped_by).name}" if stopped_by else "failed"
        reason = result.reason if result is not None and not stopped_by else None
        why = f": {reason.strip().splitlines()[-1]}" if reason and reason.strip() else ""
        raise JobFailed(f"hvdrun.run: the job {how} (exit code {code}){why}", exit_code=code)
    where = f"rank {failure.rank} on {failure.hostname}"
    outcome = max(
        (found for found in outcomes.values() if found[1].get("rank") == failure.rank),
        key=lambda found: int(found[1].get("generation", 0)),
        default=None,
    )
    if outcome is not None and not outcome[1].get("ok", True):
        error_type, error = _described(outcome[0])
        raise JobFailed(
            f"hvdrun.run: {where} raised {_raised(error_type, error)}",
            exit_code=code,
            rank=failure.rank,
            error_type=error_type,
            error=error,
        )
    if failure.stop is not None:  # (its code is the peer's that timed out waiting for it)
        how, detail = "failed first", f": {failure.error}"
    elif result is not None and failure.rank in result.lost:  # (its host was lost)
        how, detail = "was lost", f": {result.lost[failure.rank]}"
    else:
        killed = exit_signal(failure.code) is not None
        how = f"was {describe_exit(failure.code)}" if killed else f"exited with code {failure.code}"
        detail = f": {failure.error}" if failure.error else ""
    raise JobFailed(f"hvdrun.run: {where} {how}{detail}", exit_code=code, rank=failure.rank)


def _described(data: bytes) -> tuple[str, str]:
    """The type and message of the exception a rank's outcome describes."""
    try:
        described = json.loads(data)
    except ValueError:
        described = {}
    if not isinstance(described, dict):
        described = {}
    return str(described.get("type", "")), str(described.get("message", ""))


def _raise_raised(code: int, outcomes: dict[str, tuple[bytes, dict[str, Any]]]) -> None:
    """An elastic job that failed without a rank to blame (its hosts failed and it ran out
    of them, or of resets): the function's exception, where a rank's raised one, the first
    generation's lowest rank first. Returns where none did."""
    raised = [
        (fields.get("generation", 0), fields.get("rank", -1), data, fields)
        for data, fields in outcomes.values()
        if not fields.get("ok", True)
    ]
    if not raised:
        return
    generation, rank, data, fields = min(raised, key=lambda found: found[:2])
    error_type, error = _described(data)
    where = f"rank {rank}" if rank >= 0 else "a worker"
    if fields.get("host"):
        where += f" on {fields['host']}"
    if generation > 0:
        where += f" (generation {generation})"
    raise JobFailed(
        f"hvdrun.run: the elastic job failed: {where} raised {_raised(error_type, error)}",
        exit_code=code,
        rank=rank if rank >= 0 else None,
        error_type=error_type,
        error=error,
    )


class _TextWriter(io.RawIOBase):
    """Bytes written to a text stream (a notebook's ``sys.stdout`` has no binary buffer)."""

    def __init__(self, text: TextIO) -> None:
        self._text = text
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._text.write(self._decoder.decode(bytes(data)))
        return len(data)

    def flush(self) -> None:
        _flush(self._text)

    def isatty(self) -> bool:
        try:
            return bool(self._text.isatty())
        except (AttributeError, ValueError):
            return False


def binary_stream(stream: TextIO | None) -> BinaryIO | None:
    """The binary side of ``stream``: its buffer, or a writer that decodes into it."""
    if stream is None:
        return None
    buffer = getattr(stream, "buffer", None)
    if isinstance(buffer, (io.BufferedIOBase, io.RawIOBase)):
        return cast(BinaryIO, buffer)
    return cast(BinaryIO, _TextWriter(stream))


def _flush(stream: Any) -> None:
    with contextlib.suppress(AttributeError, ValueError, OSError):
        stream.flush()
