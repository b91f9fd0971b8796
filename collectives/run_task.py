"""``python -m collectives.run_task``: one rank of ``hvdrun.run(fn, ...)``.

``hvdrun.run`` starts an hvdrun job whose command is this module. Before any worker starts,
the launcher puts ``(fn, args, kwargs)``, pickled by cloudpickle, in the job's rendezvous
store under ``worker_env.FUNCTION_KEY`` (in pieces, :mod:`rendezvous.pieces`), so the
function reaches every host over the connection the worker already has, whatever the
network between the hosts. This process reads it, calls ``fn(*args, **kwargs)`` (which calls
``hvd.init()`` itself, as in any script), and leaves its outcome in the store under
``worker_env.RESULT_KEY_PREFIX`` and ``g<generation>-r<rank>`` (each generation's ranks
apart: a worker hvdrun stops as the job ends never overwrites a value another left): the
value ``fn`` returned, pickled, or a description of the exception it raised. The launcher
reads them all when the job ends.

The rank is the one hvdrun gave the worker (``HVDRUN_RANK``), or, in elastic jobs, where
ranks change, the rank the function's ``hvd.init()`` last had; the header says which
membership generation and size it belongs to, so the launcher keeps the last generation's.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from collectives.errors import describe, exit_code
from rendezvous import pieces, worker_env
from rendezvous.client import RendezvousClient, RendezvousError

#: How long a worker waits for the function (it is in the store before any worker starts).
READ_TIMEOUT = 60.0

#: The module that holds the worker's runtime (imported by the function, never by this one).
STATE_MODULE = "collectives.runtime.state"


def _place() -> tuple[str, dict[str, Any]]:
    """The key this rank's outcome goes under, and the header fields that place it."""
    # (The runtime only where the function imported it: this module never imports torch.)
    # (an elastic rank's last generation's place, even after the function's hvd.shutdown())
    state = sys.modules.get(STATE_MODULE)
    place = state.last_place() if state is not None else None
    if place is not None:
        rank, size, generation = place
        return f"g{generation}-r{rank}", {"rank": rank, "size": size, "generation": generation}
    rank_text = os.environ.get(worker_env.RANK)
    if rank_text is not None and rank_text.isdigit():
        size_text = os.environ.get(worker_env.SIZE, "")
        size = int(size_text) if size_text.isdigit() else 0
        return f"g0-r{rank_text}", {"rank": int(rank_text), "size": size, "generation": 0}
    # An elastic worker whose function never called hvd.init(): it has no rank.
    worker = os.environ.get(worker_env.WORKER, "")
    return f"worker-{worker}", {"rank": -1, "size": 0, "generation": -1}


def _store(client: RendezvousClient, ok: bool, data: bytes) -> None:
    key, fields = _place()
    host = os.environ.get(worker_env.HOSTNAME, "")
    extra = {**fields, "ok": ok, "host": host}
    stored, head = pieces.split(worker_env.RESULT_KEY_PREFIX + key, data, extra)
    for piece_key, piece in stored.items():
        client.set(piece_key, piece)
    client.set(worker_env.RESULT_KEY_PREFIX + key, head)  # last: the pieces are all there


def _call(payload: bytes) -> tuple[int, bool, bytes]:
    """Runs the pickled call: (exit code, whether it returned, its outcome's bytes)."""
    import json

    import cloudpickle

    try:
        fn, args, kwargs = cloudpickle.loads(payload)
    except Exception as error:
        return 1, False, json.dumps(_unpickling_failed(error)).encode()
    try:
        value: Any = fn(*args, **kwargs)
    except SystemExit as leaving:  # the function ended the process: its code counts
        code = exit_code(leaving)
        if code == 0:
            return 0, True, cloudpickle.dumps(None)
        sys.stderr.write(f"hvdrun.run: the function exited: {leaving.code}\n")
        return code, False, json.dumps(describe(leaving)).encode()
    except BaseException as error:
        # (from the function's own frame: this module's call of it is no news)
        below = error.__traceback__.tb_next if error.__traceback__ else None
        traceback.print_exception(type(error), error, below)
        # As for a script's uncaught exception: the other ranks are told it at this
        # process's exit (collectives.runtime.exits), not that it left the job on purpose.
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, below
        return 1, False, json.dumps(describe(error)).encode()
    try:
        return 0, True, cloudpickle.dumps(value)
    except Exception as error:
        message = f"the value the function returned cannot be pickled: {error}"
        sys.stderr.write(f"hvdrun.run: {message}\n")
        return 1, False, json.dumps(describe(TypeError(message))).encode()


def _unpickling_failed(error: Exception) -> dict[str, str]:
    """What a worker that could not unpickle the function says, and why that may be: what
    cloudpickle sends by name (a module's functions and classes) must import here too."""
    hint = (
        "the function or its arguments could not be unpickled in this worker: functions and "
        "classes of importable modules travel by name, so their modules must import here too "
        f"(this worker runs in {os.getcwd()}; put the module's directory on PYTHONPATH, or "
        "send the module by value with cloudpickle.register_pickle_by_value(module))"
    )
    sys.stderr.write(f"hvdrun.run: {type(error).__name__}: {error}\nhvdrun.run: {hint}\n")
    described = describe(error)
    described["message"] = f"{error}; {hint}"
    return described


def main() -> int:
    if worker_env.SECRET not in os.environ:
        sys.stderr.write(
            "collectives.run_task runs the ranks of hvdrun.run(fn, ...); it is not a command "
            "of its own\n"
        )
        return 2
    client = RendezvousClient.from_environment()
    try:
        try:
            payload, _ = pieces.joined(
                worker_env.FUNCTION_KEY, lambda key: client.get(key, READ_TIMEOUT)
            )
        except (RendezvousError, pieces.PiecesError) as exc:
            sys.stderr.write(f"hvdrun.run: could not read the function from hvdrun: {exc}\n")
            return 1
        code, ok, outcome = _call(payload)
        del payload
        try:
            _store(client, ok, outcome)
        except RendezvousError as exc:
            sys.stderr.write(f"hvdrun.run: could not hand the result to hvdrun: {exc}\n")
            return code or 1
        return code
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
