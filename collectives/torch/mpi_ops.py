"""Horovod's tensor collectives: names, signatures, defaults and semantics of horovod.torch.

Every ``*_async`` function submits the op to the background engine and returns an integer
handle at once; ``poll(handle)`` says whether it finished and ``synchronize(handle)`` waits
for it and returns its result (raising its error, if any). The synchronous functions are
``synchronize(*_async(...))``, with autograd support where Horovod has it:

============== ===========================================================================
allreduce      grad = allreduce(grad) with the same op and scaling (Average and Sum only)
allgather      grad = this rank's rows of allreduce(grad, Average)
broadcast      grad = allreduce(grad, Average) on the root, zeros elsewhere
alltoall       grad = alltoall(grad) sent back along the received splits
reducescatter  grad = allgather(grad * size) for Sum, allgather(grad) for Average, times
               the scaling
============== ===========================================================================

(Horovod 0.28's conventions, see :mod:`collectives.torch.autograd`.) A broadcast's
``root_rank`` is a global rank, also within a process set, as in Horovod.

``init()`` lives here too (``horovod.torch.mpi_ops.init`` in Horovod): it starts the runtime
and then registers the process sets it was given, which the runtime cannot do itself since it
sits below the process-set API.

Layering: the public op API. It applies the Functions of :mod:`collectives.torch.autograd`,
submits through :mod:`collectives.ops` and registers process sets through
:mod:`collectives.process_sets`; nothing below it imports it.
"""

from __future__ import annotations

from typing import Any

import torch

from collectives import job, ops, runtime
from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.engine import handles
from collectives.errors import HorovodInternalError
from collectives.process_sets import add_process_set, remove_process_set
from collectives.torch import autograd
from collectives.torch.compression import Compression, Compressor

#: An out-of-place allreduce of at most this many bytes that records no autograd runs as an
#: in-place one on a copy of its input (see :func:`allreduce`); a larger one keeps the
#: engine's out-of-place path, which folds an Average into the copy.
_COPIED_BYTES = 64 * 1024

# (Horovod's horovod.torch.mpi_ops holds the job's queries too: scripts import them from
# there)
__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "Max",
    "Min",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "handle_average_backwards_compatibility",
    "init",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "sparse_allreduce_async",
    "synchronize",
]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

CompressionArg = type[Compressor] | Compressor


# Framework-neutral (shared with the other frontends): see :mod:`collectives.job`.
init = job.init
handle_average_backwards_compatibility = job.handle_average_backwards_compatibility
barrier = job.barrier
join = job.join


_first = ops.first_output
_all = ops.outputs_of


def _tensor_list(tensors: Any, what: str) -> list[torch.Tensor]:
    """The tensors of a grouped op as a list. A tensor is refused: iterating over it would
    make each of its rows an op of the group."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(
            f"hvd.{what} takes a list of tensors, got a tensor; pass [tensor], or use "
            f"hvd.{what.removeprefix('grouped_')}"
        )
    return tensors if isinstance(tensors, list) else list(tensors)


# ---- allreduce ----------------------------------------------------------------------------


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing the tensor into a new tensor (default op: Average); returns a handle."""
    resolved = handle_average_backwards_compatibility(op, average)
    return handles.register(
        ops.submit_allreduce(
            [tensor],
            None,
            resolved,
            prescale_factor,
            postscale_factor,
            process_set,
            name,
            _first,
        )
    )


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: CompressionArg = Compression.none,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Returns the tensor reduced over the process set (default: averaged); the input is
    unchanged. Differentiable for Average and Sum."""
    resolved = handle_average_backwards_compatibility(op, average)
    compressed, ctx = compression.compress(tensor)
    if (
        isinstance(compressed, torch.Tensor)
        and compressed.layout is torch.strided
        and compressed.nbytes <= _COPIED_BYTES
        and not (compressed.requires_grad and torch.is_grad_enabled())
        and process_set is global_process_set
        and resolved is not ReduceOp.ADASUM
    ):
        # A small result with no autograd to record (a metric, a loss to log): reduced in
        # place on a copy, which takes the engine's hot lane once the op repeats (the same
        # op for every member: in place or not is no part of an op's description).
        reduced = compressed.clone(memory_format=torch.contiguous_format)
        ops.allreduce_in_place(
            reduced, resolved, prescale_factor, postscale_factor, process_set, name
        ).wait()
    else:
        reduced = autograd.Allreduce.apply(
            compressed, name, resolved, prescale_factor, postscale_factor, process_set
        )
    return compression.decompress(reduced, ctx)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing the tensor in place; returns a handle."""
    resolved = handle_average_backwards_compatibility(op, average)
    return handles.register(
        ops.submit_allreduce(
            [tensor],
            [tensor],
            resolved,
            prescale_factor,
            postscale_factor,
            process_set,
            name,
            lambda request: tensor,  # (in place: the engine's output may be a view of it)
        )
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces the tensor in place over the process set and returns it."""
    resolved = handle_average_backwards_compatibility(op, average)
    ops.allreduce_in_place(
        tensor, resolved, prescale_factor, postscale_factor, process_set, name
    ).wait()
    return tensor


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing a list of tensors as one op into new tensors; returns a handle."""
    tensors = _tensor_list(tensors, "grouped_allreduce_async")
    resolved = handle_average_backwards_compatibility(op, average)
    return handles.register(
        ops.submit_allreduce(
            tensors,
            None,
            resolved,
            prescale_factor,
            postscale_factor,
            process_set,
            name,
            _all,
        )
    )


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: CompressionArg = Compression.none,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces a list of tensors as one op (fused together); returns new tensors."""
    tensors = _tensor_list(tensors, "grouped_allreduce")
    resolved = handle_average_backwards_compatibility(op, average)
    if not tensors:
        return []
    packed = [compression.compress(t) for t in tensors]
    reduced = autograd.GroupedAllreduce.apply(
        name, resolved, prescale_factor, postscale_factor, process_set, *(c for c, _ in packed)
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed, strict=True)]


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts reducing a list of tensors in place as one op; returns a handle."""
    tensors = _tensor_list(tensors, "grouped_allreduce_async_")
    resolved = handle_average_backwards_compatibility(op, average)
    return handles.register(
        ops.submit_allreduce(
            tensors,
            tensors,
            resolved,
            prescale_factor,
            postscale_factor,
            process_set,
            name,
            lambda request: tensors,
        )
    )


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces a list of tensors in place as one op and returns them."""
    tensors = _tensor_list(tensors, "grouped_allreduce_")
    resolved = handle_average_backwards_compatibility(op, average)
    if tensors:
        ops.submit_allreduce(
            tensors,
            tensors,
            resolved,
            prescale_factor,
            postscale_factor,
            process_set,
            name,
            _all,
            blocking=True,
        ).wait()
    return tensors


# ---- allgather ----------------------------------------------------------------------------


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts concatenating the ranks' tensors along dim 0; returns a handle."""
    return handles.register(ops.submit_allgather([tensor], process_set, name, _first))


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenates the ranks' tensors along dim 0, in rank order; dim 0 may differ."""
    result: torch.Tensor = autograd.Allgather.apply(tensor, name, process_set)
    return result


def grouped_allgather_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts allgathering a list of tensors as one op; returns a handle."""
    tensors = _tensor_list(tensors, "grouped_allgather_async")
    return handles.register(ops.submit_allgather(tensors, process_set, name, _all))


def grouped_allgather(
    tensors: list[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Allgathers a list of tensors as one op (fused together)."""
    tensors = _tensor_list(tensors, "grouped_allgather")
    if not tensors:
        return []
    return list(autograd.GroupedAllgather.apply(name, process_set, *tensors))


# ---- broadcast ----------------------------------------------------------------------------


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts copying root_rank's tensor into a new tensor on every rank; returns a handle."""
    return handles.register(
        ops.submit_broadcast([tensor], None, root_rank, process_set, name, _first)
    )


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Returns root_rank's tensor on every rank of the process set; root_rank is a global
    rank (``hvd.rank()``), also within a process set, as in Horovod."""
    result: torch.Tensor = autograd.Broadcast.apply(tensor, root_rank, name, process_set)
    return result


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts overwriting the tensor in place with root_rank's; returns a handle."""
    return handles.register(
        ops.submit_broadcast(
            [tensor], [tensor], root_rank, process_set, name, lambda request: tensor
        )
    )


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrites the tensor in place with root_rank's values and returns it."""
    ops.submit_broadcast(
        [tensor], [tensor], root_rank, process_set, name, _first, blocking=True
    ).wait()
    return tensor


# ---- sparse allreduce ---------------------------------------------------------------------


class SparseHandle(int):
    """The handle of :func:`sparse_allreduce_async`: an integer handle like the others
    (``poll``/``synchronize``) that can also be called, as Horovod's callable is
    (``handle()`` returns the result)."""

    def __call__(self) -> torch.Tensor:
        result: torch.Tensor = synchronize(self)
        return result


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None,
    op: ReduceOp | int,
    process_set: ProcessSet = global_process_set,
) -> SparseHandle:
    """Starts reducing a sparse COO tensor (Horovod's signature): every rank's indices and
    values are allgathered, so the result is the sparse sum of the ranks' tensors, its
    values divided by the process set's size for Average. ``synchronize(handle)`` (or
    ``handle()``) returns it, coalesced."""
    return SparseHandle(
        handles.register(ops.submit_sparse_allreduce(tensor, ReduceOp(op), process_set, name))
    )


# ---- alltoall and reducescatter -----------------------------------------------------------


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an alltoall; synchronize() returns (output, received_splits)."""
    return handles.register(
        ops.submit_alltoall(tensor, splits, process_set, name, autograd.alltoall_result)
    )


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatters slices of dim 0 to the ranks (``splits[i]`` rows to rank i; even without
    splits) and gathers what they send. Returns the output, and also the received splits
    (an int32 tensor) when splits are given."""
    output, received = autograd.Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp | int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a reducescatter; returns a handle."""
    return handles.register(
        ops.submit_reducescatter(
            [tensor],
            ReduceOp(op),
            prescale_factor,
            postscale_factor,
            process_set,
            name,
            _first,
        )
    )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: CompressionArg = Compression.none,
    op: ReduceOp | int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduces the tensor over the process set and returns this rank's rows of the result:
    dim 0 split evenly, the first ``dim0 % size`` ranks getting one row more."""
    compressed, ctx = compression.compress(tensor)
    reduced = autograd.Reducescatter.apply(
        compressed, name, ReduceOp(op), prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: ReduceOp | int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Starts a reducescatter of a list of tensors as one op; returns a handle."""
    tensors = _tensor_list(tensors, "grouped_reducescatter_async")
    return handles.register(
        ops.submit_reducescatter(
            tensors,
            ReduceOp(op),
            prescale_factor,
            postscale_factor,
            process_set,
            name,
            _all,
        )
    )


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    compression: CompressionArg = Compression.none,
    op: ReduceOp | int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Reducescatters a list of tensors as one op (fused together)."""
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    if not tensors:
        return []
    packed = [compression.compress(t) for t in tensors]
    reduced = autograd.GroupedReducescatter.apply(
        name,
        ReduceOp(op),
        prescale_factor,
        postscale_factor,
        process_set,
        *(c for c, _ in packed),
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed, strict=True)]


# ---- handles, barrier, join ---------------------------------------------------------------


def poll(handle: int) -> bool:
    """Whether the op behind the handle has finished (synchronize() will not block)."""
    found = handles.lookup(handle)
    if found is None:
        raise ValueError(f"unknown handle {handle} (already synchronized?)")
    return found.done()


def synchronize(handle: int) -> Any:
    """Waits for the op behind the handle and returns its output (None for an unknown
    handle); raises the op's error: HorovodInternalError, TensorMismatchError, ..."""
    found = handles.release(handle)
    return None if found is None else found.wait()


def __getattr__(name: str) -> Any:
    """The job's queries (``rank``, ``size``, ...), which Horovod's ``mpi_ops`` holds too."""
    return runtime.job_query(__name__, name)
