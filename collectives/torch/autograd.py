"""Horovod's gradients for the collectives (``torch.autograd.Function`` subclasses).

============== ===========================================================================
allreduce      grad = allreduce(grad) with the same op and scaling (Average and Sum only)
allgather      grad = this rank's rows of allreduce(grad, Average)
broadcast      grad = allreduce(grad, Average) on the root, zeros elsewhere
alltoall       grad = alltoall(grad) sent back along the received splits
reducescatter  grad = allgather(grad * size) for Sum, allgather(grad) for Average, times
               prescale_factor * postscale_factor
============== ===========================================================================

These are Horovod 0.28's conventions, kept so that a model ported from Horovod trains the
same. They are not all the exact gradient of one objective: for the sum of every rank's loss
(what allreduce's rule computes), allgather's and broadcast's exact gradients would sum
rather than average, and a Sum reducescatter's would be ``allgather(grad)`` without the
factor ``size``. All run within the op's process set; a broadcast's root is a global rank.

The backward passes apply these Functions themselves (as Horovod's call its differentiable
public functions), so a gradient is differentiable too and higher-order gradients work.

Layering: this module sits between the public op API (:mod:`collectives.torch.mpi_ops`, which
applies these Functions) and the submission layer (:mod:`collectives.ops`, which they
submit through); it never imports ``mpi_ops``.
"""

from __future__ import annotations

from typing import Any

import torch

from collectives import ops, runtime
from collectives.common import ProcessSet, ReduceOp
from collectives.engine.requests import Request


def _own(result: torch.Tensor) -> torch.Tensor:
    """An op's result as a tensor of its own: the engine may hand out a view (of the memory
    it pooled or fused into), and autograd refuses in-place changes (``y += b``,
    ``ReLU(inplace=True)``) of a view made inside a Function; Horovod's results take them.
    The same memory, so no copy (and the engine's pool still sees it in use)."""
    if result._base is None:
        return result
    own = torch.empty(0, dtype=result.dtype, device=result.device)
    storage = result.untyped_storage()
    return own.set_(storage, result.storage_offset(), result.shape, result.stride())


def alltoall_result(request: Request) -> tuple[torch.Tensor, torch.Tensor]:
    received = torch.tensor(request.extra, dtype=torch.int32)
    return request.outputs[0], received


def _check_gradient_op(op: ReduceOp, what: str) -> None:
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(f"the gradient of {what} with op={op.name} is not supported")


# ---- autograd functions -----------------------------------------------------------------


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: Any,
        op: ReduceOp,
        pre: float,
        post: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, process_set
        handle = ops.submit_allreduce(
            [tensor], None, op, pre, post, process_set, name, ops.first_output, blocking=True
        )
        return _own(handle.wait())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _check_gradient_op(ctx.op, "allreduce")
        reduced = Allreduce.apply(grad, None, ctx.op, ctx.pre, ctx.post, ctx.ps)
        return reduced, None, None, None, None, None


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: Any,
        op: ReduceOp,
        pre: float,
        post: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, process_set
        handle = ops.submit_allreduce(
            tensors, None, op, pre, post, process_set, name, ops.outputs_of, blocking=True
        )
        return tuple(_own(output) for output in handle.wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        _check_gradient_op(ctx.op, "grouped_allreduce")
        reduced = GroupedAllreduce.apply(None, ctx.op, ctx.pre, ctx.post, ctx.ps, *grads)
        return (None, None, None, None, None, *reduced)


def _allgather_grad(grad: torch.Tensor, dims: list[int], process_set: ProcessSet) -> torch.Tensor:
    reduced = Allreduce.apply(grad, None, ReduceOp.AVERAGE, 1.0, 1.0, process_set)
    own = process_set.rank()
    return reduced.narrow(0, sum(dims[:own]), dims[own])


def _with_dims(request: Request) -> tuple[list[torch.Tensor], list[list[int]]]:
    return list(request.outputs), request.rank_dims or []


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, process_set: ProcessSet) -> torch.Tensor:
        outputs, dims = ops.submit_allgather(
            [tensor], process_set, name, _with_dims, blocking=True
        ).wait()
        ctx.dims, ctx.ps = dims[0], process_set
        return _own(outputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _allgather_grad(grad, ctx.dims, ctx.ps), None, None


class GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: Any, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        outputs, dims = ops.submit_allgather(
            tensors, process_set, name, _with_dims, blocking=True
        ).wait()
        ctx.dims, ctx.ps = dims, process_set
        return tuple(_own(output) for output in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        own = ctx.ps.rank()
        reduced = GroupedAllreduce.apply(None, ReduceOp.AVERAGE, 1.0, 1.0, ctx.ps, *grads)
        parts = [r.narrow(0, sum(d[:own]), d[own]) for r, d in zip(reduced, ctx.dims, strict=True)]
        return (None, None, *parts)


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank, ctx.ps = root_rank, process_set
        handle = ops.submit_broadcast(
            [tensor], None, root_rank, process_set, name, ops.first_output, blocking=True
        )
        return _own(handle.wait())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = Allreduce.apply(grad, None, ReduceOp.AVERAGE, 1.0, 1.0, ctx.ps)
        if runtime.rank() != ctx.root_rank:  # a global rank, also in a process set
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, process_set: ProcessSet
    ) -> tuple[torch.Tensor, torch.Tensor]:
        handle = ops.submit_alltoall(
            tensor, splits, process_set, name, alltoall_result, blocking=True
        )
        output, received = handle.wait()
        ctx.received, ctx.ps = received, process_set
        ctx.mark_non_differentiable(received)
        return _own(output), received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:
        back, _ = Alltoall.apply(grad, ctx.received, None, ctx.ps)
        return back, None, None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: Any,
        op: ReduceOp,
        pre: float,
        post: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.op, ctx.scale, ctx.ps = op, pre * post, process_set
        handle = ops.submit_reducescatter(
            [tensor], op, pre, post, process_set, name, ops.first_output, blocking=True
        )
        return _own(handle.wait())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _check_gradient_op(ctx.op, "reducescatter")
        return _reducescatter_grad(grad, ctx), None, None, None, None, None


def _reducescatter_grad(grad: torch.Tensor, ctx: Any) -> torch.Tensor:
    # Horovod's convention: Sum scales by the set's size, Average not at all (the inverse of
    # the allgather's backward, which averages), then the pre/postscale factors.
    factor = ctx.scale * (ctx.ps.size() if ctx.op == ReduceOp.SUM else 1)
    scaled = grad * factor if factor != 1.0 else grad
    result: torch.Tensor = Allgather.apply(scaled.contiguous(), None, ctx.ps)
    return result


class GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        name: Any,
        op: ReduceOp,
        pre: float,
        post: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.scale, ctx.ps = op, pre * post, process_set
        handle = ops.submit_reducescatter(
            tensors, op, pre, post, process_set, name, ops.outputs_of, blocking=True
        )
        return tuple(_own(output) for output in handle.wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        _check_gradient_op(ctx.op, "grouped_reducescatter")
        return (None, None, None, None, None, *(_reducescatter_grad(g, ctx) for g in grads))
