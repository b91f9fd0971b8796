"""``hvd.DistributedOptimizer``: data-parallel training by reducing gradients before a step.

The wrapper is an instance of a class created on the fly that derives from the wrapped
optimizer's own class (as Horovod does), so ``isinstance(opt, torch.optim.SGD)``,
``param_groups``, ``state``, ``state_dict()`` and LR schedulers keep working. It takes over
the wrapped optimizer's attributes instead of calling its ``__init__`` again, so optimizers
whose constructors need extra arguments can be wrapped too, and existing state is kept.

Each parameter gets a post-accumulate-grad hook that counts the accumulations of its
gradient; on the ``backward_passes_per_step``-th the gradient is ready. Gradients travel in
fixed *buckets*, planned once on every rank alike: Horovod's ``groups`` when given, otherwise
consecutive parameters in reverse order (about the order backward produces them), up to
25 MB each (on accelerators the first only up to 1 MB, so that communication starts early).
A bucket's asynchronous in-place grouped allreduce starts as soon as its last gradient is
ready, so it overlaps the rest of the backward pass. ``step()`` (or ``synchronize()``) starts
the buckets still waiting and waits for all. A job of one rank that cannot grow (not
elastic) has nothing to reduce: as in Horovod, the optimizer attaches no hooks there, and
``step()`` is the wrapped optimizer's own.

With ``op=hvd.Adasum`` the hook instead runs the wrapped optimizer's step for that
parameter alone on the local gradient and reduces the resulting *change* of the parameter
with Adasum, which is what Horovod's Adasum optimizer does; ``step()`` then applies the
combined change.

This module is the public face (Horovod's ``horovod.torch.optimizer``): it checks the
arguments and picks the class to mix in. The optimizers themselves live in
:mod:`collectives.torch.optim` (the base class and its buckets, and the Adasum optimizer),
which never import this module.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.torch.compression import Compression, Compressor
from collectives.torch.optim import base
from collectives.torch.optim.adasum_optimizer import DistributedAdasumOptimizer
from collectives.torch.optim.gradient_buckets import check_groups

__all__ = ["DistributedOptimizer"]

#: Starts as Horovod's warning does (which names the release that was to drop it).
NUM_GROUPS_DEPRECATED = (
    "Parameter `num_groups` has been replaced by `groups` and will be removed; "
    "groups=num_groups is used meanwhile"
)


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
    """Wraps a torch optimizer so that gradients are averaged over the ranks (reduced with
    ``op``) while backward runs, and step() applies them; an instance of the optimizer's class.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, base.DistributedOptimizerBase):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    resolved = ReduceOp(op)
    if resolved not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise ValueError(
            f"DistributedOptimizer supports op=hvd.Average, hvd.Sum or hvd.Adasum, not "
            f"{resolved.name}"
        )
    if gradient_predivide_factor != 1.0 and resolved != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be positive")
    if num_groups != 0:
        warnings.warn(NUM_GROUPS_DEPRECATED, DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    check_groups(groups, optimizer)

    mixin: type[base.DistributedOptimizerBase] = base.DistributedOptimizerBase
    if resolved == ReduceOp.ADASUM:
        mixin = DistributedAdasumOptimizer
    return base.wrap(
        mixin,
        optimizer,
        named_parameters,
        compression,
        backward_passes_per_step,
        resolved,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
