"""Horovod's Adasum optimizer: ``DistributedOptimizer(op=hvd.Adasum)``.

As soon as a parameter's gradient is ready, the wrapped optimizer steps that parameter alone
on the local gradient, and the *change* of the parameter is what is combined with Adasum
(see :mod:`collectives.adasum`) over the ranks; ``step()`` applies the combined
changes. One parameter per bucket, so that each is stepped as soon as its gradient is ready.
It is the base class with three of its steps replaced: planning, starting and finishing a
bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from collectives import ops
from collectives.torch.optim.base import DistributedOptimizerBase
from collectives.torch.optim.gradient_buckets import Bucket

__all__ = ["DistributedAdasumOptimizer"]


class DistributedAdasumOptimizer(DistributedOptimizerBase):
    """Horovod's Adasum optimizer: each rank steps on its own gradient, and the changes of
    the parameters are combined with Adasum."""

    _hvd_starts: dict[torch.Tensor, torch.Tensor]
    _hvd_group_of: dict[torch.Tensor, int]
    _hvd_skip_alone = False  # (its hooks step the parameters)

    def _hvd_plan(self, groups: Any, params: list[torch.Tensor] | None = None) -> list[Bucket]:
        if params is None:
            self._hvd_starts = {}
            params = self._hvd_params
        self._hvd_group_of = {
            param: index
            for index, group in enumerate(self.param_groups)
            for param in group["params"]
        }
        # One parameter per bucket: each is stepped as soon as its gradient is ready.
        return [Bucket([param], self._hvd_names[param]) for param in params]

    def _hvd_start(self, bucket: Bucket) -> None:
        (param,) = bucket.params
        start = self._hvd_starts.get(param)
        if start is None:
            start = self._hvd_starts[param] = torch.empty_like(param)
        with torch.no_grad():
            start.copy_(param)
            self._hvd_step_one(param)
            delta = param.data
            delta.sub_(start)
        tensor, ctx = self._hvd_compression.compress(delta)
        bucket.sent = [(param, tensor, ctx)]
        bucket.handle = ops.submit_adasum_allreduce(
            [tensor], [tensor], 1.0, 1.0, self.process_set, bucket.name, ops.first_output
        )

    def _hvd_step_one(self, param: torch.Tensor) -> None:
        """The wrapped optimizer's step for one parameter (its own state and group)."""
        stashed = [group["params"] for group in self.param_groups]
        try:
            own = self._hvd_group_of[param]
            for index, group in enumerate(self.param_groups):
                group["params"] = [param] if index == own else []
            base: Any = super(DistributedOptimizerBase, self)
            base.step()
        finally:
            for group, params in zip(self.param_groups, stashed, strict=True):
                group["params"] = params

    def _hvd_finish(self, bucket: Bucket) -> None:
        assert bucket.handle is not None
        bucket.handle.wait()
        ((param, tensor, ctx),) = bucket.sent
        start = self._hvd_starts[param]
        with torch.no_grad():
            start.add_(self._hvd_compression.decompress(tensor, ctx))
            param.copy_(start)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Applies the Adasum-combined parameter changes (each rank already stepped); a
        rank outside the optimizer's process set steps on its own gradients."""
        if not self._hvd_reduces:
            base: Any = super(DistributedOptimizerBase, self)
            return base.step(closure)
        loss = closure() if closure is not None else None
        self._hvd_sync_for_step()
        return loss

    step.hooked = True  # type: ignore[attr-defined]
