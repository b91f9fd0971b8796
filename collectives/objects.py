"""Python objects between ranks: ``broadcast_object`` and ``allgather_object``.

Framework-neutral (every frontend exports them as Horovod does): an object is pickled into a
uint8 tensor and moved with the engine's broadcast or allgather, through the submission
layer. The standard pickle comes first: it refers to classes by name, so the receiver gets
instances of its own classes; ``cloudpickle`` (as in Horovod) only for what pickle cannot
do, such as lambdas and classes defined in a script.

Names: an unnamed call is named after the function (``broadcast_object.sz`` and
``broadcast_object.t``; ``allgather_object``), never from the unnamed-op counters, so that
it matches across ranks whatever unnamed ops ran before it (see ``engine/names.py``).
Horovod names them after ``type(obj).__name__`` instead, which deadlocks where ranks pass
objects of different types (``None`` on the ranks that receive a broadcast, an ``int`` on
one rank and a ``float`` on another). Calls follow one another under the same names; calls
running at the same time from several threads need names of their own.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from collectives import ops, runtime
from collectives.common import ProcessSet, global_process_set

try:  # cloudpickle also handles lambdas and locally defined classes, as in Horovod
    import cloudpickle
except ImportError:  # pragma: no cover - optional
    cloudpickle = None

__all__ = ["allgather_object", "broadcast_object", "dumps", "loads"]


def dumps(obj: Any) -> torch.Tensor:
    # The standard pickle first: it refers to classes by name, so the receiver gets instances
    # of its own classes (cloudpickle would send classes of a script's __main__ by value, and
    # the copies compare unequal); cloudpickle only for what pickle cannot do.
    buffer = io.BytesIO()
    try:
        pickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        if cloudpickle is None:
            raise
        buffer = io.BytesIO()
        cloudpickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def loads(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Pickles obj on root_rank and returns it, unpickled, on every rank of the process set
    (root_rank is a global rank, as in Horovod)."""
    runtime.require("hvd.broadcast_object()")
    base = name or "broadcast_object"  # (see the module docstring)
    size_name, data_name = f"{base}.sz", f"{base}.t"
    if runtime.rank() == root_rank:
        payload = dumps(obj)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        ops.broadcast_([length], root_rank, process_set, size_name)
        ops.broadcast_([payload], root_rank, process_set, data_name)
        return obj
    length = torch.zeros(1, dtype=torch.int64)
    ops.broadcast_([length], root_rank, process_set, size_name)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    ops.broadcast_([payload], root_rank, process_set, data_name)
    return loads(payload)


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Pickles obj on every rank and returns the list of all ranks' objects, in rank order."""
    runtime.require("hvd.allgather_object()")
    # One allgather: the engine learns every rank's length in its negotiation.
    name = name or "allgather_object"  # (see the module docstring)
    gathered, lengths = ops.allgather(dumps(obj), process_set, name)
    result = []
    offset = 0
    for length in lengths:
        result.append(loads(gathered[offset : offset + length]))
        offset += length
    return result
