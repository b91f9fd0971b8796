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


#: The first byte of what a rank sends in place of an object it could not pickle (its error,
#: in UTF-8, follows): every pickle of protocol 2 or later starts with PROTO (0x80).
_FAILED = b"\x00"


def _dumps_or_error(obj: Any) -> tuple[torch.Tensor, BaseException | None]:
    """The pickled object, or, where it cannot be pickled, the marked message that every
    other rank receives instead (with the error this rank raises once the op is done: a
    rank that raised before it would leave the others' op waiting, or take their next op's
    data for this one's)."""
    try:
        return dumps(obj), None
    except Exception as error:  # (pickle raises several types, cloudpickle more)
        text = _FAILED + f"{type(error).__name__}: {error}".encode(errors="replace")[:4096]
        return torch.frombuffer(bytearray(text), dtype=torch.uint8), error


def _failure(data: torch.Tensor) -> str | None:
    """The error a rank sent in place of its object, or None for a pickle (looked at by its
    first byte: a pickle is not copied out for this)."""
    if data.numel() == 0 or int(data[0]) != _FAILED[0]:
        return None
    return data[1:].numpy().tobytes().decode(errors="replace")


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Pickles obj on root_rank and returns it, unpickled, on every rank of the process set
    (root_rank is a global rank, as in Horovod)."""
    runtime.require("hvd.broadcast_object()")
    _, group = ops.resolve_process_set(process_set, "hvd.broadcast_object")
    ops.root_index(root_rank, group, "hvd.broadcast_object")  # (named as what was called)
    base = name or "broadcast_object"  # (see the module docstring)
    size_name, data_name = f"{base}.sz", f"{base}.t"
    if runtime.rank() == root_rank:
        payload, error = _dumps_or_error(obj)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        ops.broadcast_([length], root_rank, process_set, size_name)
        ops.broadcast_([payload], root_rank, process_set, data_name)
        if error is not None:
            raise error
        return obj
    length = torch.zeros(1, dtype=torch.int64)
    ops.broadcast_([length], root_rank, process_set, size_name)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    ops.broadcast_([payload], root_rank, process_set, data_name)
    failed = _failure(payload)
    if failed is not None:
        raise pickle.PicklingError(
            f"hvd.broadcast_object: rank {root_rank} could not pickle its object: {failed}"
        )
    return loads(payload)


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Pickles obj on every rank and returns the list of all ranks' objects, in rank order."""
    runtime.require("hvd.allgather_object()")
    # One allgather: the engine learns every rank's length in its negotiation.
    name = name or "allgather_object"  # (see the module docstring)
    payload, error = _dumps_or_error(obj)
    gathered, lengths = ops.allgather(payload, process_set, name)
    if error is not None:
        raise error
    pieces, offset = [], 0
    for length in lengths:
        pieces.append(gathered[offset : offset + length])
        offset += length
    failures = [(i, text) for i, piece in enumerate(pieces) if (text := _failure(piece))]
    if failures:
        ranks = process_set.ranks
        raise pickle.PicklingError(
            "hvd.allgather_object: "
            + "; ".join(f"rank {ranks[i]} could not pickle its object: {t}" for i, t in failures)
        )
    return [loads(piece) for piece in pieces]
