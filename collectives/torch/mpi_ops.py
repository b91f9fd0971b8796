"""Horovod's tensor collectives: allreduce, allgather, broadcast and their variants.

This module is the public face of the ops (argument handling, Horovod's defaults and
deprecated aliases, compression, autograd support); the work itself is done by
:mod:`collectives.torch.ops`, which a later version replaces with a background engine.

The ``*_async`` functions exist so Horovod code runs unchanged. In this version the
collective runs when the function is called and the handle is already complete;
``synchronize(handle)`` returns its result and ``poll(handle)`` is always true.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Any

import torch

from collectives.torch import ops
from collectives.torch.common import ProcessSet, ReduceOp, global_process_set
from collectives.torch.compression import Compression, Compressor

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "handle_average_backwards_compatibility",
    "poll",
    "synchronize",
]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

CompressionArg = type[Compressor] | Compressor


def handle_average_backwards_compatibility(op: Any, average: Any) -> ReduceOp:
    """Resolves Horovod's deprecated ``average=`` flag against ``op`` (default Average)."""
    if op is not None:
        if average is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return ReduceOp(op)
    if average is not None:
        warnings.warn(
            "the average= argument is deprecated; use op=hvd.Average or op=hvd.Sum",
            DeprecationWarning,
            stacklevel=3,
        )
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE


# ---- autograd functions ---------------------------------------------------------------


def _reduce_backward(
    grad: torch.Tensor, op: ReduceOp, pre: float, post: float, ps: ProcessSet
) -> torch.Tensor:
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(
            f"the gradient of an allreduce with op={op.name} is not supported"
        )
    return allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, prescale_factor, postscale_factor, process_set
        output = tensor.detach().clone(memory_format=torch.contiguous_format)
        ops.allreduce_([output], op, prescale_factor, postscale_factor, process_set, name)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        grad = _reduce_backward(grad_output, ctx.op, ctx.pre, ctx.post, ctx.ps)
        return grad, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: str | None,
        op: ReduceOp,
        prescale_factor: float,
        postscale_factor: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, prescale_factor, postscale_factor, process_set
        outputs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        ops.allreduce_(outputs, op, prescale_factor, postscale_factor, process_set, name)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if ctx.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise NotImplementedError(
                f"the gradient of an allreduce with op={ctx.op.name} is not supported"
            )
        reduced = grouped_allreduce(
            list(grads),
            op=ctx.op,
            prescale_factor=ctx.pre,
            postscale_factor=ctx.post,
            process_set=ctx.ps,
        )
        return (None, None, None, None, None, *reduced)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        output, firsts = ops.allgather(tensor, process_set, name)
        ctx.firsts, ctx.ps = firsts, process_set
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        # Each rank's slice of the output depends only on that rank's input; the output's
        # gradient is averaged over ranks, as in Horovod.
        reduced = allreduce(grad_output, op=ReduceOp.AVERAGE, process_set=ctx.ps)
        own = ctx.ps.rank()
        offset = sum(ctx.firsts[:own])
        return reduced.narrow(0, offset, ctx.firsts[own]), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank, ctx.ps = root_rank, process_set
        output = tensor.detach().clone(memory_format=torch.contiguous_format)
        ops.broadcast_([output], root_rank, process_set, name)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        reduced = allreduce(grad_output, op=ReduceOp.AVERAGE, process_set=ctx.ps)
        if ctx.ps.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


# ---- allreduce ------------------------------------------------------------------------


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
    """Returns the tensor averaged (default) or otherwise reduced over all ranks.

    The input is not modified; gradients flow through for op Average and Sum.
    """
    resolved = handle_average_backwards_compatibility(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(
        compressed, name, resolved, prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(reduced, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduces the tensor in place over all ranks (default: average) and returns it."""
    resolved = handle_average_backwards_compatibility(op, average)
    ops.allreduce_([tensor], resolved, prescale_factor, postscale_factor, process_set, name)
    return tensor


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
    """Reduces a list of tensors as one fused operation; returns new tensors."""
    resolved = handle_average_backwards_compatibility(op, average)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(
        name, resolved, prescale_factor, postscale_factor, process_set, *(c for c, _ in packed)
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed, strict=True)]


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduces a list of tensors in place as one fused operation and returns them."""
    resolved = handle_average_backwards_compatibility(op, average)
    ops.allreduce_(tensors, resolved, prescale_factor, postscale_factor, process_set, name)
    return tensors


# ---- allgather / broadcast ------------------------------------------------------------


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenates the ranks' tensors along dim 0, in rank order; dim 0 may differ."""
    result: torch.Tensor = _Allgather.apply(tensor, name, process_set)
    return result


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Returns a copy of root_rank's tensor on every rank; the input is not modified."""
    result: torch.Tensor = _Broadcast.apply(tensor, root_rank, name, process_set)
    return result


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrites the tensor in place with root_rank's values and returns it."""
    ops.broadcast_([tensor], root_rank, process_set, name)
    return tensor


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Blocks until every rank has called barrier()."""
    ops.barrier(process_set)


# ---- async handles --------------------------------------------------------------------

_handles: dict[int, torch.Tensor] = {}
_handles_lock = threading.Lock()
_next_handle = itertools.count(1)


def _completed(result: torch.Tensor) -> int:
    with _handles_lock:
        handle = next(_next_handle)
        _handles[handle] = result
    return handle


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an allreduce into a new tensor; returns a handle for synchronize()."""
    resolved = handle_average_backwards_compatibility(op, average)
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    ops.allreduce_([output], resolved, prescale_factor, postscale_factor, process_set, name)
    return _completed(output)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an in-place allreduce; returns a handle for synchronize()."""
    resolved = handle_average_backwards_compatibility(op, average)
    ops.allreduce_([tensor], resolved, prescale_factor, postscale_factor, process_set, name)
    return _completed(tensor)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Starts an allgather; returns a handle for synchronize()."""
    output, _ = ops.allgather(tensor, process_set, name)
    return _completed(output)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts a broadcast into a new tensor; returns a handle for synchronize()."""
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    ops.broadcast_([output], root_rank, process_set, name)
    return _completed(output)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Starts an in-place broadcast; returns a handle for synchronize()."""
    ops.broadcast_([tensor], root_rank, process_set, name)
    return _completed(tensor)


def poll(handle: int) -> bool:
    """Whether the operation behind the handle has completed."""
    return True


def synchronize(handle: int) -> torch.Tensor | None:
    """Waits for the operation behind the handle and returns its output tensor."""
    with _handles_lock:
        return _handles.pop(handle, None)
