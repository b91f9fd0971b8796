"""How a reduction combines tensors: the op and its scaling, and the two steps around it.

Every reducing path of the engine (a fused bucket, a single tensor in place, a
reducescatter, small allreduces reduced locally from gathered data, the response cache's
rounds) runs the same sequence:

1. **stage** -- the input goes where the collective reads it (a fusion buffer, a staging
   vector, the output itself), multiplied by ``prescale``;
2. the collective sums (or takes the min, max, product) over the ranks;
3. **finish** -- the result is multiplied by ``postscale`` and, for ``Average``, divided by
   the number of ranks.

:class:`Reduction` holds the three values that decide it (they are part of an op's
negotiated signature, so every rank runs the same steps) and does steps 1 and 3. Integers
are scaled in float64 and truncated toward zero, and an integer average rounds toward zero,
as in Horovod. Staging copies first and then scales in the target's dtype, so a staging
buffer of another dtype (the cache's float64 vector) gets the same bits as before.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from collectives.common import ReduceOp

__all__ = ["PLAIN_SUM", "Reduction", "finish_", "neutral_value", "scale_"]

_AVERAGE = int(ReduceOp.AVERAGE)
_SUM = int(ReduceOp.SUM)


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiplies in place (integers: in float64, truncated toward zero)."""
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_(torch.trunc(tensor.to(torch.float64) * factor))


def finish_(tensor: torch.Tensor, op: int, postscale: float, size: int) -> None:
    """Step 3 of a reduction over ``size`` ranks, in place: postscale, and the average."""
    if op != _AVERAGE:
        scale_(tensor, postscale)
    elif tensor.is_floating_point() or tensor.is_complex() or postscale != 1.0:
        scale_(tensor, postscale / size)
    else:
        tensor.copy_(torch.div(tensor, size, rounding_mode="trunc"))


def neutral_value(op: int, dtype: torch.dtype) -> float | int | bool:
    """The element that leaves a reduction unchanged (what a joined rank contributes)."""
    if op in (_SUM, _AVERAGE):
        return 0
    if op == ReduceOp.PRODUCT:
        return 1
    if dtype == torch.bool:
        return op == ReduceOp.MIN
    if dtype.is_floating_point:
        return math.inf if op == ReduceOp.MIN else -math.inf
    info = torch.iinfo(dtype)
    return info.max if op == ReduceOp.MIN else info.min


class Reduction(NamedTuple):
    """An allreduce's or reducescatter's op (a :class:`ReduceOp` value) and scaling."""

    op: int
    prescale: float = 1.0
    postscale: float = 1.0

    @property
    def sums(self) -> bool:
        """Whether the collective sums (Sum and Average)."""
        return self.op == _SUM or self.op == _AVERAGE

    @property
    def plain_sum(self) -> bool:
        """A Sum with no scaling: the summed data is the result as it is."""
        return self.op == _SUM and self.postscale == 1.0

    def stage(self, target: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Step 1: ``target`` becomes ``source`` (None: itself) times ``prescale``; a
        copy casts to ``target``'s dtype first."""
        factor = self.prescale
        if source is not None:
            if (
                factor != 1.0
                and source.dtype == target.dtype
                and (target.is_floating_point() or target.is_complex())
            ):
                torch.mul(source, factor, out=target)  # (the same bits as copy, then scale)
                return
            target.copy_(source)
        if factor != 1.0:
            scale_(target, factor)

    def finish(self, tensor: torch.Tensor, size: int) -> None:
        """Step 3 over ``size`` ranks, in place."""
        finish_(tensor, self.op, self.postscale, size)


#: A Sum with no scaling: the default of requests that reduce nothing, and a staging that
#: only copies.
PLAIN_SUM = Reduction(_SUM)
