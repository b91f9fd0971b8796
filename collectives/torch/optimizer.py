"""``hvd.DistributedOptimizer``: data-parallel training by averaging gradients before a step.

The wrapper is an instance of a class created on the fly that derives from the wrapped
optimizer's own class (as Horovod does), so ``isinstance(opt, torch.optim.SGD)``,
``param_groups``, ``state``, ``state_dict()`` and LR schedulers keep working. It takes over
the wrapped optimizer's attributes instead of calling its ``__init__`` again, so optimizers
whose constructors need extra arguments can be wrapped too, and existing state is kept.

In this version ``step()`` reduces all gradients when it is called, as one grouped allreduce
(the engine fuses them per dtype). Overlapping the reduction with the backward pass through
gradient hooks (``allreduce_async_`` as each gradient becomes ready) comes next.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from collectives.torch import ops, runtime
from collectives.torch.common import ProcessSet, ReduceOp, global_process_set
from collectives.torch.compression import Compression, Compressor

__all__ = ["DistributedOptimizer"]

logger = logging.getLogger(__name__)


def _sparse_allreduce(grad: torch.Tensor, op: ReduceOp, process_set: ProcessSet) -> torch.Tensor:
    """Reduces a sparse gradient by gathering every rank's indices and values."""
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(
            f"sparse gradients support op=Average or Sum, not {op.name}; use sparse_as_dense=True"
        )
    grad = grad.coalesce()
    # allgather concatenates along dim 0, so the (ndim, nnz) indices travel transposed.
    indices, _ = ops.allgather(grad.indices().t().contiguous(), process_set, "sparse.indices")
    values, _ = ops.allgather(grad.values().contiguous(), process_set, "sparse.values")
    if op == ReduceOp.AVERAGE:
        values = values / process_set.size()
    result = torch.sparse_coo_tensor(indices.t(), values, grad.size(), check_invariants=False)
    return result.coalesce()


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed in front of the wrapped optimizer's class (never instantiated alone)."""

    _hvd_params: list[torch.Tensor]
    _hvd_compression: type[Compressor] | Compressor
    _hvd_op: ReduceOp
    _hvd_predivide: float
    _hvd_sparse_as_dense: bool
    _hvd_process_set: ProcessSet
    _hvd_backward_passes_per_step: int
    _hvd_param_names: dict[int, str]
    _hvd_should_synchronize: bool
    _hvd_synchronized: bool

    def _hvd_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor] | Compressor,
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        all_params: list[torch.Tensor] = []
        seen: set[int] = set()
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) not in seen:
                    seen.add(id(param))
                    all_params.append(param)
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
                raise ValueError(
                    "named_parameters must be a sequence of (name, parameter) tuples, "
                    "as model.named_parameters() yields"
                )
        else:
            named = [
                (f"allreduce.noname.{i}.{j}", param)
                for i, group in enumerate(self.param_groups)
                for j, param in enumerate(group["params"])
            ]
        names = [name for name, _ in named]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(
                f"parameter names in named_parameters must be unique; repeated: {duplicates}"
            )
        named_ids = {id(param) for _, param in named}
        unnamed = [param for param in all_params if id(param) not in named_ids]
        if unnamed:
            shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
            raise ValueError(
                f"named_parameters was given but {len(unnamed)} of the optimizer's parameters "
                f"are not in it (shapes {shapes})"
            )
        self._hvd_param_names = {id(param): name for name, param in named}
        self._hvd_params = [p for p in all_params if p.requires_grad]
        self._hvd_compression = compression
        self._hvd_op = op
        self._hvd_predivide = gradient_predivide_factor
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_process_set = process_set
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._hvd_should_synchronize = True
        self._hvd_synchronized = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Sets how many backward passes accumulate locally before gradients are reduced."""
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes}")
        self._hvd_backward_passes_per_step = passes

    def synchronize(self) -> None:
        """Averages (or reduces with the optimizer's op) the gradients across all ranks now."""
        runtime.require("DistributedOptimizer.synchronize()")
        dense: list[torch.Tensor] = []
        sparse: list[torch.Tensor] = []
        for param in self._hvd_params:
            if param.grad is None:
                # Another rank may have a gradient for it (dynamic graphs): every rank must
                # hand the same tensors to the collective.
                param.grad = torch.zeros_like(param)
            if param.grad.is_sparse:
                if self._hvd_sparse_as_dense:
                    param.grad = param.grad.to_dense()
                    dense.append(param)
                else:
                    sparse.append(param)
            else:
                dense.append(param)
        if self._hvd_op == ReduceOp.AVERAGE:
            prescale, postscale = 1.0 / self._hvd_predivide, self._hvd_predivide
        else:
            prescale, postscale = 1.0, 1.0
        grads = [param.grad for param in dense if param.grad is not None]
        packed = [self._hvd_compression.compress(grad) for grad in grads]
        ops.allreduce_(
            [tensor for tensor, _ in packed],
            self._hvd_op,
            prescale,
            postscale,
            self._hvd_process_set,
            "DistributedOptimizer.gradients",
        )
        for grad, (tensor, ctx) in zip(grads, packed, strict=True):
            if tensor is not grad:
                grad.copy_(self._hvd_compression.decompress(tensor, ctx))
        for param in sparse:
            assert param.grad is not None
            param.grad = _sparse_allreduce(param.grad, self._hvd_op, self._hvd_process_set)
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context step() does not reduce gradients (after an explicit
        synchronize(), e.g. to clip the averaged gradients)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduces the gradients across ranks (unless already done), then steps."""
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() was called after optimizer.synchronize() outside "
                    "optimizer.skip_synchronize(); the gradients are not reduced a second time",
                    stacklevel=2,
                )
            else:
                self.synchronize()
        self._hvd_synchronized = False
        base: Any = super()
        return base.step() if closure is None else base.step(closure)

    # The wrapped class's own step already runs the step hooks and the profiler; marking this
    # one as hooked keeps Optimizer._patch_step_function (run by load_state_dict) from
    # wrapping it a second time, which would run every step hook twice.
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, as the wrapped optimizer does."""
        self._hvd_synchronized = False
        super().zero_grad(set_to_none)


_classes: dict[type, type] = {}


def _wrapper_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
        cls.__qualname__ = base.__qualname__
        _classes[base] = cls
    return cls


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] | Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp | int = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Wraps a torch optimizer so that step() first averages the gradients of all ranks.

    The result is an instance of the optimizer's own class (a dynamic subclass).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    resolved = ReduceOp(op)
    if resolved == ReduceOp.ADASUM:
        raise NotImplementedError(
            "DistributedOptimizer(op=hvd.Adasum) is not implemented by hvdrun yet"
        )
    if gradient_predivide_factor != 1.0 and resolved != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be positive")
    if num_groups != 0:
        warnings.warn(
            "num_groups is deprecated; use groups= (gradients are fused per dtype anyway)",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    _check_groups(groups, optimizer)

    cls: Any = _wrapper_class(type(optimizer))
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        resolved,
        gradient_predivide_factor,
        sparse_as_dense,
        process_set,
    )
    return wrapped


def _check_groups(groups: Any, optimizer: torch.optim.Optimizer) -> None:
    """Validates ``groups`` as Horovod does; grouping itself is implied by per-dtype fusion."""
    if groups is None:
        return
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative integer, got {groups}")
        return
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise ValueError("groups must be an integer or a list of lists of parameters")
    known = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for group in groups:
        for param in group:
            if id(param) not in known:
                raise ValueError("groups contains a tensor that is not one of the optimizer's")
